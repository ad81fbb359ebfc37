// Creates a topic, or does nothing if it exists: the one admin step the
// e2e scenarios need from the host. Run by `e2e/kafka/broker create-topic`
// with the broker's own jars (Java's single-file source launcher).
import java.util.List;
import java.util.Map;
import java.util.concurrent.ExecutionException;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AdminClientConfig;
import org.apache.kafka.clients.admin.NewTopic;
import org.apache.kafka.common.errors.TopicExistsException;

public class CreateTopic {
    public static void main(String[] args) throws Exception {
        if (args.length != 3) {
            System.err.println("usage: CreateTopic BOOTSTRAP TOPIC PARTITIONS");
            System.exit(2);
        }
        try (Admin admin = Admin.create(Map.of(AdminClientConfig.BOOTSTRAP_SERVERS_CONFIG, args[0]))) {
            admin.createTopics(List.of(new NewTopic(args[1], Integer.parseInt(args[2]), (short) 1))).all().get();
            System.err.println("created topic " + args[1] + " with " + args[2] + " partitions");
        } catch (ExecutionException e) {
            if (!(e.getCause() instanceof TopicExistsException)) {
                throw e;
            }
        }
    }
}
